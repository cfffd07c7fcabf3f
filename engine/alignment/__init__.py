"""The aligner stage around any engine: segment audio in, a forced aligner's word times out."""
