from epdserve.cli import main

main()
