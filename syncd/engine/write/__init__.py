"""Writing a planned output in one pass over its source.

`planned` turns a plan into moves and writes header, padding and carried tensors; `onepass` runs the moves
(read once, hash, transform with `kernels`, write); `checks` proves what was written without reading it back
(the write ledger and the in-cache check of every transposed block).
"""
