"""What people read: the figures, the report, and the paper sets (export, verify, redraw)."""
