"""`python -m planner` and the `planner` command. Ctrl-C while the command line loads (importing
numpy, OR-Tools and the rest takes a moment) ends as cleanly as a Ctrl-C later on."""
import signal
import sys


def entry() -> int:
    from planner.signals import HELD, held_while_loading
    try:
        with held_while_loading():
            from planner.cli import main
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    code = main()
    if code in (130, 143):
        # the command has said it was interrupted: a signal still pending (held while a module
        # loaded, or a second Ctrl-C) must not end the interpreter's shutdown as killed by it
        for sig in HELD:
            signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(entry())
