"""Pure values and rules, no torch and no look at this machine: the config keys (:mod:`~autofit.core.config`),
the devices as values and their presets (:mod:`~autofit.core.hardware`), what a machine's software runs
(:mod:`~autofit.core.software`), the user's recipe (:mod:`~autofit.core.recipe`), the search space
(:mod:`~autofit.core.space`), the rules that prune it (:mod:`~autofit.core.rules`), units, errors and the typed
boundary readers (:mod:`~autofit.core.boundary`)."""
