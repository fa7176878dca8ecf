"""Measurement, pure side: the probes' fit (`probes`), calibrating a profile to measured runs
(`calibrate`), the published-runs fit (`fit`), judging the model on published runs (`validate`),
how far this machine is from its profile now (`machine_speed`), and writing a profile
(`profile_doc`, `profile_file`). The torch side, which times kernels and steps, is
runtime.profiler; the split keeps `planner validate` and `search` free of torch."""
