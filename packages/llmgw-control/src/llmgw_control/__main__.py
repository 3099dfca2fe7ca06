from llmgw_control.cli import main

main()
