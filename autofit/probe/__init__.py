"""The parent side of a probe: run one candidate out of process for a few real (or fake) steps and measure it
(:func:`~autofit.probe.run.run_probe` of a :class:`~autofit.probe.records.ProbeSpec` that
:mod:`~autofit.probe.spec` builds from the plan, its result :class:`~autofit.probe.result.ProbeResult`). The ranks are started
(:mod:`~autofit.probe.launch`, :mod:`~autofit.probe.elastic`, :mod:`~autofit.probe.nodes`), their exits classified
(:mod:`~autofit.probe.failure`, :mod:`~autofit.probe.oom_killer`); DeepSpeed's ops are built first
(:mod:`~autofit.probe.ops`); the CPU's kernel footprint (:mod:`~autofit.probe.footprint`) and the CUDA memory snapshot
(:mod:`~autofit.probe.snapshot`) are probes too. What runs inside a rank is :mod:`autofit.probe.rank`; the two
sides hand over through :mod:`autofit.probe.records`."""
