"""Cost model (hardware/cluster profiles, per-op and collective costs, memory).

Empty until the cost-model capability lands; nothing imports it yet.
"""
