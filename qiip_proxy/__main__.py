from qiip_proxy import main

main()
