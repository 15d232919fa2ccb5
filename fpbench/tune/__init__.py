"""`fpbench tune`: a fair hyperparameter search (Optuna) over a suite's methods.

Every method compared gets the same number of trials and the same round budget, scored on a
validation split carved from its clients' train data (`train.validation`), never the test split;
trials are pruned on the stored per-round validation metric. The study lives in the results
database (SQLite, or PostgreSQL shared by parallel workers), so a killed search continues where
it stopped, and the best configuration becomes a suite of its own (`NAME+tuned`).

`space` reads the search spaces (data beside the recipes), `study` runs the search and
`best` writes the tuned suite.
"""
