"""Pure optimizer math on local tensors (no communication, no optimizer state objects).

Muon's Newton-Schulz orthogonalisation, the Adam/AdamW update, block-wise 8-bit
quantization with a dynamic code map and the 8-bit Adam step, and Shampoo's matrix
inverse roots and tiles. The optimizer classes route local blocks to these functions;
each is tested in one process against torch.optim, scipy or a float64 reference.
"""

from ._adam import adam_foreach_, adamw_step_, check_adam_hparams
from ._matrix_root import matrix_inverse_root, shampoo_tiles
from ._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    muon_adjust_lr,
    muon_cost,
    muon_matrix_view,
    zeropower_via_newtonschulz,
)
from ._quant8 import (
    TableQuantizer,
    adam8bit_block_step_,
    dequantize_blockwise,
    dequantize_table,
    dynamic_code_map,
    num_blocks,
    quantize_blockwise,
)

__all__ = [
    "NS_COEFFICIENTS",
    "NS_EPS",
    "NS_STEPS",
    "TableQuantizer",
    "adam8bit_block_step_",
    "adam_foreach_",
    "adamw_step_",
    "check_adam_hparams",
    "dequantize_blockwise",
    "dequantize_table",
    "dynamic_code_map",
    "matrix_inverse_root",
    "muon_adjust_lr",
    "muon_cost",
    "muon_matrix_view",
    "num_blocks",
    "quantize_blockwise",
    "shampoo_tiles",
    "zeropower_via_newtonschulz",
]
