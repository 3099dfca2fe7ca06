from llmgw_agent.cli import main

main()
