"""Quality measurements against full attention: the retrieval and list-answer tasks
(``tasks``, ``runner``), teacher-forced fidelity (``fidelity``), free generation
(``generation``), support stability (``stability``), per-sample diagnoses (``diagnose``) and
the reports and figures (``report``, ``figures``)."""
