"""Write a random-weight DFlash draft for a target GGUF (luced.runtime.tiny.draft), in the
GGUF and the safetensors layout.

    python tools/make_tiny_draft.py TARGET.gguf OUT_DIR [--seed S] [--layers N]
        [--captures N] [--block-size B] [--sliding-window W --sliding-layers TF..] [--dtype f16]
"""

from luced.runtime.tiny.cli import draft_main

if __name__ == "__main__":
    draft_main()
