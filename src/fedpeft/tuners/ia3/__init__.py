"""(IA)^3 (Liu et al. 2022) through Hugging Face PEFT (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.ia3.options import IA3Options


def register() -> None:
    """Register ia3 (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("ia3", options=IA3Options, apply="fedpeft.tuners.ia3.apply:apply_ia3",
                                 save_format="peft", trains_task_head=True, analytic_ops="fedpeft.tuners.ia3.ops:ia3_ops",
                                 head_params="fedpeft.heads.layout:qkv_head_params",
                                 row_forwards={"peft.tuners.ia3.layer:Linear": "fedpeft.tuners.ia3.row_forward:ia3_linear_rows"})
