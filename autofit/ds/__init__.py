"""The DeepSpeed dialect: every DeepSpeed key autofit writes or reads. The JSON (:mod:`~autofit.ds.emit`, its
constants in :mod:`~autofit.ds.constants`), the ZeRO buckets (:mod:`~autofit.ds.buckets`) and NVMe swap buffers
(:mod:`~autofit.ds.swap_buffers`), the recipe read back from a user's JSON (:mod:`~autofit.ds.recipe_from`), the
launchers that take the JSON (:mod:`~autofit.ds.launchers`), and what its ``"autofit"`` section means applied to a
model (:mod:`~autofit.ds.apply`, :mod:`~autofit.ds.optim`, :mod:`~autofit.ds.fp8`)."""
