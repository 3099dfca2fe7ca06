from llmgw_router.cli import main

main()
