"""The paper's figures (SPEC §12), one module per group, sharing `style`."""
