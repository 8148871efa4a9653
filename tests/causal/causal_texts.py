"""The clean and corrupted texts of the patching tests (equal token lengths on every tiny tokenizer)."""

CLEAN = "the cat sat on the mat"
CORRUPT = "the dog sat on the mat"
