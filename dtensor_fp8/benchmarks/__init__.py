"""Benchmarks: ``python -m dtensor_fp8.benchmarks <subcommand> [options]`` (see ``__main__``)."""
