"""`python -m threadpar.run [torchrun's options] script.py [args...]`: see threadpar/run/cli.py."""

from threadpar.run.cli import main

main()
