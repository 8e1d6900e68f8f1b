"""graphopt.planner: search DP/ZeRO/TP+SP/CP/PP/EP plans with the cost model (docs/planner.md)."""
