"""``python -m batchlab ...`` (and ``torchrun --nproc-per-node N -m batchlab measure --dp N ...``)."""
from batchlab.cli import main

main()
