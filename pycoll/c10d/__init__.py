"""The torch surface: the c10d ProcessGroup, its argument checks and plans, point-to-point, Work."""
