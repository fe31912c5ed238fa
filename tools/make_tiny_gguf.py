"""Write a tiny random-weight GGUF of a model family (luced.runtime.tiny), as llama.cpp's
converter would write it; `--hf-dir` also writes the Hugging Face model it converts.

    python tools/make_tiny_gguf.py FAMILY OUT.gguf [--seed S] [--qtype T] [--hf-dir DIR]
                                   [--set KEY=VALUE ...]
"""

from luced.runtime.tiny.cli import gguf_main

if __name__ == "__main__":
    gguf_main()
