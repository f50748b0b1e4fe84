"""The programs that use pycoll: torch's own clients (DDP, FSDP2, DTensor, DCP...), our tools
and command line, the benchmark, and the installed wheel."""
