"""One-off investigations kept runnable (`python -m benchmarks.probes.<name>`); README.md lists them. They are not
maintained numbers: the maintained benchmarks are listed by `python -m benchmarks`."""
