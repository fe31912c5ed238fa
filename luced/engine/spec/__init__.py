"""Speculative decoding: proposers the scheduler asks for draft tokens.

ngram.py     PromptLookup: continuations of the request's own n-grams (--draft ngram)
windows.py   DraftWindows: whether a sequence speculates, and the window it asks for
sizer.py     StepCosts and BlockSizer: the draft window that maximizes expected tokens
             per second from measured step costs and observed acceptance
proposer.py  Proposer: fills a step's draft windows (the DFlash draft model on its
             worker, or the n-gram lookup), walks a grammar through them, and writes
             the q rows a sampled verify is rejection-sampled against
"""
