from qiip_proxy import main

if __name__ == "__main__":
    main()
