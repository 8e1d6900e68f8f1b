"""Communication schedules for expert parallelism (see :mod:`graphopt.kernels.comm.all_to_all`)."""

from graphopt.kernels.comm.all_to_all import SCHEDULES, RoundTrip, block_transpose, round_trip_keys

__all__ = ["SCHEDULES", "RoundTrip", "block_transpose", "round_trip_keys"]
