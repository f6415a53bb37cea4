"""Training data: parallel text -> SentencePiece -> token-budget batches.

    data.py       read and encode the corpus (cached, fingerprinted), shard it per rank, batch it
    spm.py        train the joint SentencePiece model with the project's special ids
    sampling.py   subword regularisation for training batches only
    synthetic.py  the built-in made-up language pair, so training needs no download
"""
