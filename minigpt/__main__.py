"""`python3 -m minigpt COMMAND [FLAGS]`: the `minigpt` console script, for an environment whose scripts folder is
not on PATH."""

from minigpt.cli.main import main

main()
