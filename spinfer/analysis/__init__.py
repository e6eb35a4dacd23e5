"""Analysis: compression-ratio study against scipy and closed-form baselines, roofline model."""
