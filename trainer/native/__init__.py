"""What the trainer takes from the machine and its installation: the C++ extensions, compiled once per CPU type and
cached (extensions.py; `python -m trainer.native build`), glibc's allocator kept from returning freed memory
(memory.py), and the optional Python packages, named by the extra that installs them (extras.py)."""
