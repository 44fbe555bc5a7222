"""TIDE: keeps EAGLE3 draft models fitted to the traffic a serving fleet actually sees.

One package per stage of the loop: ``serving`` (engines, the SGLang plugin, the
fleet), ``lake`` (captured hidden states in S3), ``training`` (SpecForge drafts),
``evaluation`` (acceptance length, segments, the gate), ``registry`` (MLflow),
``orchestration`` (what the Airflow DAGs call), ``ui`` (the Airflow view); beside
them ``target_model`` (the demo's own target model), ``stack`` (the local services) and
``harness`` (benchmarks); ``config``, ``errors``, ``names`` and ``cli`` serve all.
"""

__version__ = "0.1.0"
