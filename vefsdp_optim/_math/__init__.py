"""Pure optimizer math on local tensors (no communication, no optimizer state objects).

Muon's Newton-Schulz orthogonalisation (with Polar Express's coefficients) and
NorMuon's neuron-wise normalization, the Adam/AdamW update, block-wise 8-bit
quantization with a dynamic code map and the 8-bit Adam step, Shampoo's matrix
inverse roots and tiles, and SOAP's factors, eigenbases, rotations and step. The
optimizer classes route local blocks to these functions; each is tested in one process
against torch.optim, scipy or a float64 reference.
"""

from ._adam import adam_foreach_, adamw_step_, check_adam_hparams
from ._matrix_root import matrix_inverse_root, shampoo_tiles
from ._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    check_ns_coefficients,
    muon_adjust_lr,
    muon_cost,
    muon_matrix_view,
    zeropower_via_newtonschulz,
)
from ._normuon import NORMUON_EPS, normuon_normalize_
from ._polar_express import (
    POLAR_EXPRESS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    polar_express_coefficients,
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
from ._shampoo import SHAMPOO_ROOT, ShampooTile, shampoo_step_, shampoo_update_statistics_
from ._soap import (
    SoapGeometry,
    SoapHparams,
    SoapState,
    soap_eigenbasis,
    soap_geometry,
    soap_power_iteration,
    soap_project,
    soap_project_back,
    soap_step_,
    soap_update_factors_,
)

__all__ = [
    "NORMUON_EPS",
    "NS_COEFFICIENTS",
    "NS_EPS",
    "NS_STEPS",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "SHAMPOO_ROOT",
    "ShampooTile",
    "SoapGeometry",
    "SoapHparams",
    "SoapState",
    "TableQuantizer",
    "adam8bit_block_step_",
    "adam_foreach_",
    "adamw_step_",
    "check_adam_hparams",
    "check_ns_coefficients",
    "dequantize_blockwise",
    "dequantize_table",
    "dynamic_code_map",
    "matrix_inverse_root",
    "muon_adjust_lr",
    "muon_cost",
    "muon_matrix_view",
    "normuon_normalize_",
    "num_blocks",
    "polar_express_coefficients",
    "quantize_blockwise",
    "shampoo_step_",
    "shampoo_tiles",
    "shampoo_update_statistics_",
    "soap_eigenbasis",
    "soap_geometry",
    "soap_power_iteration",
    "soap_project",
    "soap_project_back",
    "soap_step_",
    "soap_update_factors_",
    "zeropower_via_newtonschulz",
]
