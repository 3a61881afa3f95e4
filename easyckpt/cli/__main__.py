import sys

from easyckpt.cli.main import main

sys.exit(main())
