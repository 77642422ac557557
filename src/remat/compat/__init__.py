"""The bottom room: every transformers version difference, and the tested version ranges."""
