"""The paper's figures (method §12), one module per group, sharing `style`."""
