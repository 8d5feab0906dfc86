"""Pure optimizer math on local tensors (no communication, no optimizer state objects).

Each optimizer's mathematics is one function on tensors and hyperparameters, documented
as torch's functional optimizers are, and the definition a reader can take for the
algorithm:

    AdamW, Adam         adamw_step_            (torch.optim.adamw.adamw's single-tensor bits)
    8-bit Adam(W)       adam8bit_block_step_   (a run of whole quantization blocks;
                        adam8bit_multi_tensor_step_ for many at once)
    Shampoo             shampoo_step_          (a run of whole tiles: row bands of a matrix)
    SOAP                soap_step_             (a whole tensor; any slice without factors)
    Muon                muon_step_             (a whole tensor: momentum, Newton-Schulz per
                                                block, lr adjustment, decay; 8-bit momentum)
    NorMuon             normuon_step_

The optimizer classes and the step loop only route data to them: which rank, which
slice, the exchange. Where batching across blocks is needed for speed, the batched form
is the same function on each block, bit for bit (tests/test_math_functional.py):
``adam_foreach_`` (torch's multi-tensor Adam over a bucket) and ``adamw_step_`` over a
whole flat store; ``adam8bit_multi_tensor_step_`` (the fused 8-bit kernels over a
bucket, one call on the CPU); Muon's
batched Newton-Schulz (``muon_orthogonalize_batched``, beside ``muon_orthogonalize`` in
_muon.py) and NorMuon's (``normuon_orthogonalize_batched``, beside ``normuon_step_`` in
_normuon.py, with the batched normalization ``normuon_normalize_batched_``). Muon's
blocks, their costs and lr adjustment are in _muon_blocks.py. Muon runs its step in
three phases on different ranks (see vefsdp_optim/_math/_muon.py), each a function
that ``muon_step_`` composes.

Also here: Newton-Schulz (with Polar Express's coefficients), NorMuon's normalization,
block-wise 8-bit quantization with a dynamic code map, Shampoo's inverse roots and
tiles, SOAP's factors, eigenbases and rotations; each tested in one process against
torch.optim, scipy or a float64 reference.
"""

from ._adam import adam_foreach_, adamw_step_, check_adam_hparams
from ._adam8bit_step import (
    adam8bit_block_step_,
    adam8bit_capturable_step_,
    adam8bit_multi_tensor_step_,
)
from ._matrix_root import matrix_inverse_root
from ._muon import (
    Int8Momentum,
    MuonBlock,
    muon_apply_,
    muon_apply_foreach_,
    muon_lr_runs,
    muon_momentum_,
    muon_momentum_foreach_,
    muon_orthogonalize,
    muon_orthogonalize_batched,
    muon_step_,
)
from ._muon_blocks import (
    muon_adjust_lr,
    muon_batch_view,
    muon_block_unit,
    muon_blocks,
    muon_blocks_cost,
    muon_cost,
    muon_matrix_view,
)
from ._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    NsCoefficients,
    check_ns_coefficients,
    zeropower_via_newtonschulz,
)
from ._normuon import (
    NORMUON_EPS,
    normuon_normalize_,
    normuon_normalize_blocks,
    normuon_orthogonalize_batched,
    normuon_step_,
)
from ._polar_express import (
    POLAR_EXPRESS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    polar_express_coefficients,
)
from ._quant8 import (
    TableQuantizer,
    dequantize_blockwise,
    dequantize_table,
    dynamic_code_map,
    host_table_quantizers,
    num_blocks,
    quantize_blockwise,
)
from ._shampoo import (
    SHAMPOO_ROOT,
    ShampooTile,
    shampoo_step_,
    shampoo_tiles,
    shampoo_update_statistics_,
)
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
    "Int8Momentum",
    "MuonBlock",
    "NORMUON_EPS",
    "NS_COEFFICIENTS",
    "NS_EPS",
    "NS_STEPS",
    "NsCoefficients",
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
    "adam8bit_multi_tensor_step_",
    "adam8bit_capturable_step_",
    "adam_foreach_",
    "adamw_step_",
    "check_adam_hparams",
    "check_ns_coefficients",
    "dequantize_blockwise",
    "dequantize_table",
    "dynamic_code_map",
    "host_table_quantizers",
    "matrix_inverse_root",
    "muon_adjust_lr",
    "muon_apply_",
    "muon_apply_foreach_",
    "muon_batch_view",
    "muon_block_unit",
    "muon_blocks",
    "muon_blocks_cost",
    "muon_cost",
    "muon_lr_runs",
    "muon_matrix_view",
    "muon_momentum_",
    "muon_momentum_foreach_",
    "muon_orthogonalize",
    "muon_orthogonalize_batched",
    "muon_step_",
    "normuon_normalize_",
    "normuon_normalize_blocks",
    "normuon_orthogonalize_batched",
    "normuon_step_",
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
