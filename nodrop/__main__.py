"""`python -m nodrop COMMAND`: the same as the `nodrop` console script."""

from nodrop.cli import main

raise SystemExit(main())
