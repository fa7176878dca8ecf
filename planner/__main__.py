"""`python -m planner` and the `planner` command. Ctrl-C while the command line loads (importing
numpy, OR-Tools and the rest takes a moment) ends as cleanly as a Ctrl-C later on."""
import sys


def entry() -> int:
    from planner.signals import held_while_loading
    try:
        with held_while_loading():
            from planner.cli import main
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(entry())
