"""Planning: the shared request and its setup (:mod:`~autofit.planning.target`), the plan made once
(:mod:`~autofit.planning.plan`), every candidate priced (:mod:`~autofit.planning.estimate`) and the ladder
(:mod:`~autofit.planning.ladder`)."""
