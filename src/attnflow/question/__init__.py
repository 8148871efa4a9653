"""`attnflow.why`: one prediction explained by every kind of evidence attnflow has, within a budget,
cross-checked, in plain language (`run.why`, `result.Why`; docs/why.md)."""
