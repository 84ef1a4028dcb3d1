"""Run one phase of the resume case (see handler_case.resume_case); prints RESULT {json} per rank.

    python tests/scripts/train_resume.py straight|first|second CKPT
    torchrun --nproc_per_node=2 tests/scripts/train_resume.py ...
"""
import json
import sys

from handler_case import resume_case

from nn_handler import cleanup_ddp

row = resume_case(sys.argv[1], sys.argv[2])
print("RESULT " + json.dumps({k: v for k, v in row.items()}), flush=True)
cleanup_ddp()
