"""The rank side of a probe: what runs inside each probe process. The rank's main
(:mod:`~autofit.probe.rank.worker`), the measured steps (:mod:`~autofit.probe.rank.steps`), the memory meter
(:mod:`~autofit.probe.rank.meter`, :mod:`~autofit.probe.rank.memory`), fake mode (:mod:`~autofit.probe.rank.fake`)
and the elastic agent of a node (:mod:`~autofit.probe.rank.agent`). It reads its spec and writes its result through
:mod:`autofit.probe.records`, the one hand-off with the parent side."""
