"""The run skeleton every command's run shares: what a run is (:mod:`~strop.run.kinds`,
the registry of run kinds), what it refuses before anything loads
(:mod:`~strop.run.preflight`), what it holds while it runs (:mod:`~strop.run.job`: the
run directory, the steps, checkpoints and the export), its progress report
(:mod:`~strop.run.progress`), Ctrl-C / SIGTERM (:mod:`~strop.run.interrupts`) and a step
the backend refused as non-finite (:mod:`~strop.run.nonfinite`)."""
