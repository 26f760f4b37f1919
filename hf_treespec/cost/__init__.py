"""What a step costs on this machine: the cost curve c(rows, context), the speed model behind
``tree_budget="auto"``, the loops' clock and the hardware facts (CPU flags, fast dtype)."""
