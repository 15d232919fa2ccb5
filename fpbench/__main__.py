from fpbench.cli import main

main()
