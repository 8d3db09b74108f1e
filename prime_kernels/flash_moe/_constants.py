"""Pure-Python mirror of csrc/flash_moe_constants.h, used only when the extension is not
built (so shape rules can still be asked on a machine without the kernel). A test checks
that it equals what the compiled extension exports."""

BLOCK_M = 128
MXFP8_SCALE_BLOCK = 32
DIM_MULTIPLE = 64
HIDDEN_MULTIPLE = 64
MXFP8_DIM_MULTIPLE = 128
MXFP8_HIDDEN_MULTIPLE = 128
MAX_EXPERTS = 4096
MAX_ROWS = 2**31 - 1
