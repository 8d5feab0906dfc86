from vefsdp_optim.estimate import main

main()
