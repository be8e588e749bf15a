"""`python -m threadpar.demo`: a GPT trained with DP x TP x PP on rank threads (see __main__.py)."""
