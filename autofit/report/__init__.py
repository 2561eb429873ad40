"""What a person reads: the report folder (:mod:`~autofit.report.folder`), the ladder's report
(:mod:`~autofit.report.ladder`), the CLI's tables (:mod:`~autofit.report.tables`) and the pictures
(:mod:`~autofit.report.plots`)."""
