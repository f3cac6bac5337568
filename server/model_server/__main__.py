import sys

from model_server.cli import main

sys.exit(main())
