"""Everything that looks at this machine: its devices (:mod:`~autofit.machine.device`), NVML
(:mod:`~autofit.machine.nvml`), its software (:mod:`~autofit.machine.software`) and its fingerprint
(:mod:`~autofit.machine.fingerprint`)."""
