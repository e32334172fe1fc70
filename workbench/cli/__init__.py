"""The command lines, in one place: ``workbench`` (:mod:`workbench.cli.main`) and its subcommands
``kv-calc`` (:mod:`~workbench.cli.kv_calc`), ``simulate`` (:mod:`~workbench.cli.simulate`) and
``bench serve`` (:mod:`~workbench.cli.bench_serve`); the options generated from ``EngineConfig``
(:mod:`~workbench.cli.options`); and how a bad value becomes an error message (:mod:`~workbench.cli.errors`).

This package imports nothing itself, so that a subcommand's module loads without the others.
"""
